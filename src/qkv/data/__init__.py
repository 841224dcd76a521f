"""Data for training: embedded tasks, tokenizers and data files.

Shapes: B batch, N padded sequence length.

- Tasks (``qkv.data.tasks``): ``TASKS``, ``get_task(name, *, seed=0) -> Task``, ``Task``,
  ``DatesTask``, ``StringTask`` (copy / reverse / sort), ``AdditionTask``. Counter-based and
  deterministic; held-out splits disjoint from train.
- Dates (``qkv.data.dates``): ``DATE_FORMATS``, ``render_date``, ``date_sample``,
  ``date_examples``, ``date_split``, ``chinese_number``; ``long_date`` and
  ``date_long_examples`` (English long dates, the ``dates-long`` task ``DatesLongTask`` of
  ``qkv demo lora``).
- Tokenizers (``qkv.data.tokenizer``): ``CharTokenizer``, ``BPETokenizer``,
  ``read_tokenizer``; their shared base (``qkv.data.tokenizer_base``) ``TokenizerBase``,
  ``SPECIALS`` (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3).
- Tokenizers of HF encoder-decoder directories (``qkv.data.seq2seq_tokenizer``):
  ``load_seq2seq_tokenizer(directory) -> Seq2SeqTokenizer`` (tokenizer.json, Marian's
  source/target.spm + vocab.json, T5's spiece.model; ids framed as transformers frames them),
  ``check_embedding_rows``.
- Files (``qkv.data.files``): ``read_pairs`` (TSV source<TAB>target), ``read_text``,
  ``DataError`` (a ValueError).
- Images (``qkv.data.shapes``): ``ShapesDataset`` (synthetic coloured shapes, captions in
  English / Chinese, (colour, shape) combinations held out of training), ``SHAPES``,
  ``COLOURS``, ``COMBINATIONS``, ``heldout_combinations``, ``class_prompts``;
  (``qkv.data.images_folder``) ``ImageFolderDataset`` (a folder of images + a captions TSV),
  ``load_image``.
- Image-caption pairs for CLIP training: ``ShapesPairs`` (``qkv.data.shapes_pairs``: the
  shapes task, a quarter of its captions zero-shot prompts), ``FolderPairs``
  (``qkv.data.folder_pairs``: a folder, whole images held out); ``encode_texts``
  (``qkv.data.clip_text``: texts as the CLIP text tower reads them, (B, N) ids and mask).
- Reading order (``qkv.data.order``): ``epoch_indices``, ``derived_seed`` (seeded per-epoch
  permutations: a step's items are a pure function of (seed, position)).
- Interleaved image QA (``qkv.data.shapes_qa``): ``ShapesQADataset`` (rows like "<image> Q:
  what colour is the circle? A: red."), ``QARow``, ``QAPair``, ``QABatch``, ``IMAGE_CHAR`` (the
  ``<image>`` character, U+FFFC), ``qa_alphabet``, ``image_token_id``.
- Pronoun resolution (``qkv.data.coref``): ``CorefExample``, ``coref_examples``,
  ``coref_sentence``, ``coref_split``, ``coref_vocabulary``, ...; ``WordTokenizer``
  (``qkv.data.words``, one id per word).
"""

from .clip_text import encode_texts
from .coref import (
    COREF_KINDS,
    COREF_LANGS,
    CorefExample,
    coref_examples,
    coref_lexicon,
    coref_sentence,
    coref_split,
    coref_split_pairs,
    coref_vocabulary,
)
from .dates import (
    DATE_FORMATS,
    DateSample,
    chinese_number,
    date_examples,
    date_long_examples,
    date_sample,
    date_split,
    long_date,
    render_date,
)
from .files import DataError, read_pairs, read_text
from .folder_pairs import FolderPairs
from .images_folder import ImageFolderDataset, load_image
from .seq2seq_base import Seq2SeqTokenizer, check_embedding_rows
from .seq2seq_tokenizer import load_seq2seq_tokenizer
from .shapes import (
    COLOURS,
    COMBINATIONS,
    SHAPES,
    ShapesBatch,
    ShapesDataset,
    class_prompts,
    heldout_combinations,
)
from .shapes_pairs import ShapesPairs
from .shapes_qa import (
    IMAGE_CHAR,
    QABatch,
    QAPair,
    QARow,
    ShapesQADataset,
    image_token_id,
    qa_alphabet,
)
from .tasks import TASKS, AdditionTask, DatesLongTask, DatesTask, StringTask, Task, get_task
from .tokenizer import SPECIALS, BPETokenizer, CharTokenizer, read_tokenizer
from .tokenizer_base import TokenizerBase
from .words import WordTokenizer

__all__ = ["COREF_KINDS", "COREF_LANGS", "DATE_FORMATS", "SPECIALS", "TASKS", "AdditionTask",
           "BPETokenizer", "CharTokenizer", "CorefExample", "DataError", "DateSample", "DatesTask",
           "StringTask", "Task", "WordTokenizer", "chinese_number", "coref_examples",
           "coref_lexicon", "coref_sentence", "coref_split", "coref_split_pairs",
           "coref_vocabulary", "date_examples", "date_sample", "date_split", "get_task",
           "read_pairs", "read_text", "read_tokenizer", "render_date"]
__all__ += ["DatesLongTask", "date_long_examples", "long_date"]
__all__ += ["COLOURS", "COMBINATIONS", "SHAPES", "ImageFolderDataset", "ShapesBatch",
            "ShapesDataset", "class_prompts", "heldout_combinations", "load_image"]
__all__ += ["IMAGE_CHAR", "QABatch", "QAPair", "QARow", "ShapesQADataset", "image_token_id",
            "qa_alphabet"]
__all__ += ["FolderPairs", "ShapesPairs", "TokenizerBase", "encode_texts"]
__all__ += ["Seq2SeqTokenizer", "check_embedding_rows", "load_seq2seq_tokenizer"]
