"""End-to-end demos behind ``qkv demo``: ``dates`` (train the encoder-decoder Transformer on
date normalisation) and ``coref`` (self-attention linking pronouns to their antecedents)."""
