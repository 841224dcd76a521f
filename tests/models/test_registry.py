"""The one door ``qkv.models.from_pretrained`` and the one table of model types
(``qkv.models.registry``): every kind of directory loads through the door to the model the
class method gives (``torch.equal``), and to the model that was saved (or, for HF
directories, to transformers' own outputs); device/dtype are honoured; unknown types and
marks without a reader are one clear error; ``src/qkv/models`` has no import circle.

Shapes: B batch, N length, V vocab, C width; images (B, 3, H, W).
Tolerances: door vs class method, saved vs loaded: exact (torch.equal: the same files and
the same code path). fp64 vs fp32 outputs: atol 1e-5 (the fp32 rounding of a 2-layer model
of width ≤ 64). HF vs qkv: fp32 atol 1e-4 (other kernels and summation orders).
"""

from __future__ import annotations

import ast
import json
import warnings
from pathlib import Path

import pytest
import torch

import qkv
from qkv.files import ADAPTER_MARK, CHECKPOINT_DIR, FSDP_MARK
from qkv.models import (
    BERT,
    CLIP,
    GPT,
    BERTConfig,
    CheckpointError,
    CLIPConfig,
    Flamingo,
    GPTConfig,
    Transformer,
    TransformerConfig,
    ViT,
    ViTConfig,
    from_pretrained,
    registry,
)
from qkv.models.quantized import QuantizedLinear, QuantizedMLMHead

MODELS_DIR = Path(qkv.__file__).parent / "models"


def _gpt() -> GPT:
    return GPT(GPTConfig.from_name("gpt-tiny", vocab_size=61, max_len=32, dim=32,
                                   num_heads=4)).eval()


def _bert() -> BERT:
    return BERT(BERTConfig.from_name("bert-tiny", vocab_size=53, max_len=32, dim=32,
                                     num_heads=4, ffn_hidden=64)).eval()


def _vit() -> ViT:
    return ViT(ViTConfig.from_name("vit-tiny", dim=16, image_size=16, patch_size=8,
                                   num_heads=2)).eval()


def _clip() -> CLIP:
    return CLIP(CLIPConfig.from_name("clip-tiny")).eval()


def _transformer() -> Transformer:
    return Transformer(TransformerConfig.from_name("transformer-tiny")).eval()


def _ids(vocab: int, b: int = 2, n: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(5))


def _text(b: int = 2, n: int = 7) -> torch.Tensor:
    """CLIP-tiny text ids (vocab 512), each row ending in its end-of-text token 511."""
    ids = _ids(511, b, n)
    ids[:, -1] = 511
    return ids


def _images(size: int, b: int = 2) -> torch.Tensor:
    return torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(6))


def _outputs(model, inputs: dict) -> list[torch.Tensor]:
    """The tensors a model returns for ``inputs`` (a dataclass/tuple output flattened)."""
    with torch.no_grad():
        out = model(*inputs["args"])
    if isinstance(out, torch.Tensor):
        return [out]
    fields = out._asdict() if hasattr(out, "_asdict") else vars(out)
    return [v for v in fields.values() if isinstance(v, torch.Tensor)]


#: name -> (build, inputs)
KINDS = {
    "gpt": (_gpt, lambda: {"args": (_ids(61),)}),
    "bert": (_bert, lambda: {"args": (_ids(53),)}),
    "transformer": (_transformer, lambda: {"args": (_ids(32), _ids(32, n=5))}),
    "vit": (_vit, lambda: {"args": (_images(16),)}),
    "clip": (_clip, lambda: {"args": (_images(32), _text())}),
}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_door_loads_a_qkv_directory_as_the_class_method(kind, tmp_path):
    build, inputs = KINDS[kind]
    torch.manual_seed(0)
    model = build()
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    x = inputs()
    _same(_outputs(loaded, x), _outputs(type(model).from_pretrained(tmp_path), x))
    _same(_outputs(loaded, x), _outputs(model, x))  # the oracle: the model that was saved


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_door_loads_a_quantized_directory(kind, tmp_path):
    build, inputs = KINDS[kind]
    torch.manual_seed(1)
    model = qkv.quantize(build())
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert loaded.quantization["modules"] == model.quantization["modules"]
    assert any(isinstance(m, QuantizedLinear) for m in loaded.modules())
    assert not any(type(m) is torch.nn.Linear for m in loaded.modules())
    if kind == "bert":  # the MLM decoder (the word embeddings) gets its own int8 copy
        assert isinstance(loaded.mlm, QuantizedMLMHead)
        assert isinstance(loaded.mlm.decoder, QuantizedLinear)
        assert loaded.word_embeddings.weight.dtype == torch.float32
    x = inputs()
    _same(_outputs(loaded, x), _outputs(type(model).from_pretrained(tmp_path), x))
    _same(_outputs(loaded, x), _outputs(model, x))
    with pytest.raises(CheckpointError, match=r"int8.*dtype=torch\.float64"):
        from_pretrained(tmp_path, dtype=torch.float64)


def test_quantize_refuses_a_model_that_is_not_quantizable():
    with pytest.raises(TypeError, match=r"qkv GPT, Transformer or BERT, got ViT"):
        qkv.quantize(_vit())


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """HF GPT2LMHeadModel and BertModel directories written by transformers from small random
    configs (non-trivial biases and norms), and the models that wrote them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=61, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    bert = transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=53, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).eval()
    out = {}
    for name, model in (("gpt2", gpt2), ("bert", bert)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(path, safe_serialization=True)
        out[name] = (path, model)
    return out


def test_door_loads_hf_directories(hf_dirs):
    ids = _ids(61)
    path, hf = hf_dirs["gpt2"]
    loaded = from_pretrained(path)
    assert isinstance(loaded, GPT) and not loaded.training
    with torch.no_grad():
        got = loaded(ids)
        assert torch.equal(got, GPT.from_hf(path)(ids))
        assert torch.equal(got, GPT.from_pretrained(path)(ids))
        assert torch.equal(got, qkv.models.from_hf(path)(ids))
        torch.testing.assert_close(got, hf(ids).logits, atol=1e-4, rtol=0)
    path, hf = hf_dirs["bert"]
    ids = _ids(53)
    loaded = from_pretrained(path)
    assert isinstance(loaded, BERT) and loaded.pooler is not None and loaded.mlm is None
    with torch.no_grad():
        got = loaded(ids)
        want = BERT.from_hf(path)(ids)
        assert torch.equal(got.last_hidden_state, want.last_hidden_state)
        assert torch.equal(got.pooler_output, want.pooler_output)
        ref = hf(ids)
        torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state, atol=1e-4,
                                   rtol=0)


def test_dtype_float64_gives_fp64_params_and_outputs_close_to_fp32(hf_dirs, tmp_path):
    torch.manual_seed(3)
    model = _gpt()
    model.save_pretrained(tmp_path)
    ids = _ids(61)
    for path in (tmp_path, hf_dirs["gpt2"][0]):
        loaded = from_pretrained(path, dtype=torch.float64, device="cpu")
        assert {p.dtype for p in loaded.parameters()} == {torch.float64}
        assert {p.device.type for p in loaded.parameters()} == {"cpu"}
        assert loaded.lm_head.weight is loaded.embed.weight  # the tie survives
        with torch.no_grad():
            got, ref = loaded(ids), from_pretrained(path)(ids)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, ref.double(), atol=1e-5, rtol=0)
    bert = from_pretrained(hf_dirs["bert"][0], dtype=torch.float64)
    assert {p.dtype for p in bert.parameters()} == {torch.float64}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_builds_there(hf_dirs, tmp_path):
    torch.manual_seed(4)
    model = _bert()
    model.save_pretrained(tmp_path / "bert")
    qkv.quantize(_gpt()).save_pretrained(tmp_path / "q")
    for path in (tmp_path / "bert", hf_dirs["gpt2"][0], tmp_path / "q"):
        loaded = from_pretrained(path, device="cuda")
        assert {t.device.type for t in loaded.state_dict().values()} == {"cuda"}
    with torch.no_grad():
        got = from_pretrained(tmp_path / "bert", device="cuda")(_ids(53).cuda())
    torch.testing.assert_close(got.last_hidden_state.cpu(),
                               model(_ids(53)).last_hidden_state, atol=1e-4, rtol=0)


def test_door_loads_a_run_directory(tmp_path):
    torch.manual_seed(5)
    model = _gpt()
    run = tmp_path / "run"
    model.save_pretrained(run / CHECKPOINT_DIR)
    (run / "run.json").write_text("{}")
    loaded = from_pretrained(run)
    _same(_outputs(loaded, {"args": (_ids(61),)}), _outputs(model, {"args": (_ids(61),)}))


def test_door_loads_a_flamingo_directory(tmp_path):
    torch.manual_seed(6)
    lm = GPT(GPTConfig.from_name("gpt-tiny", vocab_size=24, max_len=32, dim=32, num_heads=4))
    model = Flamingo(lm, _vit(), image_token_id=5, num_latents=3).eval()
    with torch.no_grad():
        for block in model.gated.values():
            block.attn_gate.fill_(0.8)
    out = model.save_pretrained(tmp_path / "fl", include_bases=True)
    loaded = from_pretrained(out)
    assert isinstance(loaded, Flamingo) and not loaded.training
    ids = torch.randint(6, 24, (2, 9))
    ids[:, 2] = 5
    images = _images(16).unsqueeze(1)  # (B, 1, 3, 16, 16)
    with torch.no_grad():
        got = loaded(ids, images)
        assert torch.equal(got, Flamingo.from_pretrained(out)(ids, images))
        assert torch.equal(got, model(ids, images))
        assert from_pretrained(out, dtype=torch.float64)(ids, images.double()).dtype \
            == torch.float64


def test_unknown_model_type_is_one_error_listing_the_known_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(CheckpointError) as info:
        from_pretrained(tmp_path)
    msg = str(info.value)
    assert "'falcon'" in msg and "FalconForCausalLM" in msg
    for known in registry.known_model_types():
        assert known in msg
    with pytest.raises(CheckpointError,
                       match=r"model_type None .*known: bart, bert, clip, gemma, "):
        registry.entry_for(None)
    with pytest.raises(CheckpointError, match=r"not supported; supported: \['bart', 'bert', "
                                              r"'clip', 'gemma', 'gemma2', 'gpt2', 'llama', "
                                              r"'marian', 'mistral', 'phi3', 'qwen2', "
                                              r"'qwen3', 't5', 'vit'\]"):
        qkv.models.from_hf(tmp_path)


def test_a_directory_of_no_known_kind_says_what_it_looks_for(tmp_path):
    with pytest.raises(CheckpointError, match=r"no such directory"):
        from_pretrained(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"no config\.json .*flamingo_config\.json.*"
                                              r"sharded\.json.*checkpoint/"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("mark, what, call", [
    (FSDP_MARK, r"sharded checkpoint of a `qkv train --fsdp` run", r"qkv export RUN"),
    (ADAPTER_MARK, r"adapter run's checkpoint", r"qkv peft merge RUN"),
])
def test_a_mark_without_a_reader_says_what_the_directory_is(mark, what, call, tmp_path,
                                                           monkeypatch):
    for name in registry.directory_readers():  # qkv.train may have registered them
        monkeypatch.delitem(registry._READERS, name)
    _gpt().save_pretrained(tmp_path / CHECKPOINT_DIR)
    (tmp_path / CHECKPOINT_DIR / mark).write_text("{}")
    with pytest.raises(CheckpointError, match=rf"{what}.*no reader for it is registered.*"
                                              rf"load_run\(RUN\).*{call}"):
        from_pretrained(tmp_path)  # the run directory: its checkpoint holds the mark


def test_a_registered_reader_reads_its_mark_with_device_and_dtype(tmp_path, monkeypatch):
    seen = {}
    model = _gpt()

    def reader(directory, *, device=None, dtype=None):
        seen.update(directory=directory, device=device, dtype=dtype)
        return model.train()

    monkeypatch.setitem(registry._READERS, FSDP_MARK, reader)
    (tmp_path / FSDP_MARK).write_text("{}")
    (tmp_path / "config.json").write_text("{}")  # a --fsdp checkpoint has both
    got = from_pretrained(tmp_path, dtype=torch.float64)
    assert seen == {"directory": tmp_path, "device": None, "dtype": torch.float64}
    assert got is model and not got.training
    assert {p.dtype for p in got.parameters()} == {torch.float64}
    with pytest.raises(ValueError, match="plain file name"):
        registry.register_directory_reader("a/b.json", reader)
    with pytest.raises(TypeError, match="callable"):
        registry.register_directory_reader("x.json", None)


def test_entries_agree_with_their_classes():
    for entry in registry.ENTRIES:
        assert entry.model_type == entry.config_class.MODEL_TYPE
        readers = getattr(entry.model_class, "hf_mappings", ()) or tuple(
            m for m in (getattr(entry.model_class, "hf_mapping", None),) if m is not None)
        assert entry.hf_model_types == tuple(m.model_type for m in readers)
        assert entry.quantizable == bool(getattr(entry.model_class, "quantizable", False))
        assert registry.model_class(entry.model_type) is entry.model_class
    assert {e.model_type for e in registry.ENTRIES if e.quantizable} == {
        "qkv-gpt", "qkv-bert", "qkv-transformer"}
    with pytest.raises(ValueError, match=r"quantizable=True, but ViT\.quantizable is False"):
        registry.ModelEntry("qkv-vit", ViTConfig, ViT, ("vit",), quantizable=True)
    with pytest.raises(ValueError, match=r"hf_model_types \(\), but GPT\.hf_mapping reads"):
        registry.ModelEntry("qkv-gpt", GPTConfig, GPT, quantizable=True)
    assert registry.entry_for("qwen3").model_class is GPT  # each family a line of the table


# --- the import graph of src/qkv/models -------------------------------------------------------
def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module of qkv.models it imports, names taken) for every import of ``path``, at module
    level and inside functions (a lazy import is an arrow too)."""
    found = []
    modules = {p.stem for p in MODELS_DIR.glob("*.py")}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                target = base
            elif node.level == 2 and base.startswith("models"):
                target = base.removeprefix("models").lstrip(".")
            elif node.level == 0 and base.startswith("qkv.models"):
                target = base.removeprefix("qkv.models").lstrip(".")
            else:
                continue
            names = [a.name for a in node.names]
            if target == "":  # from . import x
                for name in names:
                    found.append((name if name in modules else "__init__", [name]))
            else:
                found.append((target.split(".")[0], names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("qkv.models."):
                    found.append((alias.name.split(".")[2], []))
    return found


def _graph() -> dict[str, set[str]]:
    return {p.stem: {t for t, _ in _imports(p) if t != p.stem}
            for p in MODELS_DIR.glob("*.py")}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_models_have_no_import_circle():
    graph = _graph()
    assert {"registry", "hub", "gpt", "hf_gpt2", "quantized"} <= set(graph)
    assert "gpt" in graph["registry"] and "hf_gpt2" in graph["gpt"]  # the graph is read
    assert _cycle(graph) is None, f"import circle in src/qkv/models: {_cycle(graph)}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    # the loaders know no model: only the registry (and the package) import the models
    for low in ("hub", "loading", "quantized", "hf_load", "weights", "config",
                "hf_gpt2", "hf_bert", "hf_vit", "hf_clip"):
        assert not graph[low] & {"gpt", "bert", "vit", "clip", "transformer", "flamingo",
                                 "registry"}, (low, graph[low])


def test_models_import_no_private_name_across_files():
    bad = [(p.name, target, name) for p in MODELS_DIR.glob("*.py")
           for target, names in _imports(p) for name in names
           if name.startswith("_") and not name.startswith("__")]
    assert bad == []
    tree = ast.parse((MODELS_DIR / "__init__.py").read_text())
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                   for n in tree.body)
