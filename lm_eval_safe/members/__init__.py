"""Members: where a model comes from and what the decoder knows of it.

``sources`` resolves a member spec once (aliases, GGUF files, ``stores/``); ``checkpoints`` and
``gguf_info`` load and read the files; ``member`` is the engine-neutral tokenizer side;
``vocabulary`` turns tokens into bytes and boundaries (docs/algorithm.md, Token strings and
alignment); ``placement`` says which device each member runs on.
"""
