"""Tiny tokenizers of the two families real evaluation models use, trained in-process for the
unit tests: GPT-2 style byte-level BPE (SmolLM2, Qwen) and SentencePiece-style BPE with byte
fallback (Llama-2, Gemma), on a corpus generated in code.

They are real ``tokenizers`` pipelines (the same component types as the published
``tokenizer.json`` files of those families), so the edge cases that matter for log-likelihood
scoring -- leading-space handling, BOS insertion, byte fallback for unseen characters,
multi-byte characters split across tokens -- all occur for real. Deterministic, a couple of
seconds on a CPU; nothing here imports pytest.
"""

from __future__ import annotations

import json
import random
from collections import Counter

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

# --------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------

_NAMES = [
    "Natalia",
    "James",
    "Weng",
    "Betty",
    "Julie",
    "Mark",
    "Albert",
    "Ken",
    "Alexis",
    "Tina",
    "José",
    "Zoë",
]
_ITEMS = [
    "clips",
    "apples",
    "books",
    "pencils",
    "marbles",
    "cookies",
    "stickers",
    "tickets",
    "eggs",
    "coins",
]
_PLACES = [
    "the market",
    "school",
    "the park",
    "Zürich",
    "São Paulo",
    "the library",
    "Kraków",
    "the café",
]
_ADJ = [
    "quick",
    "lazy",
    "bright",
    "quiet",
    "naïve",
    "curious",
    "tiny",
    "enormous",
    "ancient",
    "modern",
]
_NOUNS = [
    "fox",
    "dog",
    "student",
    "teacher",
    "robot",
    "river",
    "mountain",
    "résumé",
    "piano",
    "garden",
]
_VERBS = [
    "jumps over",
    "looks at",
    "walks to",
    "writes about",
    "thinks about",
    "runs past",
    "paints",
    "finds",
]
_ACCENTED = [
    "café",
    "naïve",
    "résumé",
    "façade",
    "jalapeño",
    "Ångström",
    "über",
    "crème brûlée",
    "piñata",
    "Øresund",
]
_CJK = [
    "你好，世界。",
    "数学问题：三加四等于七。",
    "こんにちは、世界！",
    "答えは42です。",
    "안녕하세요",
    "学生在学校学习。",
]
_EMOJI = ["🙂", "🚀", "✅", "🎉", "❤️", "👍🏽", "🐍"]
_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "x = [n ** 2 for n in range(5)]  # squares\n",
    'assert f("abc") == "ABC", "upper-case"\n',
    "int main(void) {\n\treturn 0;\n}\n",
    "while (k < n) { k += 2; }\n",
    "import math\nprint(math.sqrt(16))\n",
]
_LATEX = [
    r"$\frac{1}{2} + \frac{1}{3} = \frac{5}{6}$",
    r"The answer is $\boxed{42}$.",
    r"\sqrt{x^2 + y^2} \leq |x| + |y|",
    r"$$\sum_{k=1}^{n} k = \frac{n(n+1)}{2}$$",
    r"\int_0^1 x^2 \, dx = \frac{1}{3}",
    r"Let $f(x) = 3x^2 - 2x + 7$. Then $f(2) = \boxed{15}$.",
    r"\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}",
    r"$\alpha + \beta = \gamma$, so $\theta = \pi / 4$.",
]


def build_default_corpus(n_lines: int = 360, seed: int = 1234) -> list[str]:
    """Generate a deterministic, varied training corpus.

    Why generated rather than a fixture file: it keeps the test models self-contained and
    lets the mix (prose, GSM8K-like word problems, LaTeX answers, code with indentation,
    runs of spaces, newlines, accents, CJK, emoji) be tuned in one place. The mix mirrors
    what the evaluation tasks feed the backend, so the learned merges hit the same kinds
    of boundaries (digits, ``\\boxed{``, leading spaces) that real tokenizers do.
    """
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 9
        name = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        if kind == 0:
            lines.append(
                f"The {rng.choice(_ADJ)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
                f"{rng.choice(_ADJ)} {rng.choice(_NOUNS)} near {rng.choice(_PLACES)}."
            )
        elif kind == 1:
            lines.append(
                f"Question: {name} had {a} {item} and bought {b} more at {rng.choice(_PLACES)}. "
                f"How many {item} does {name} have now?\nAnswer: {a} + {b} = {a + b}. #### {a + b}"
            )
        elif kind == 2:
            c = rng.randint(2, 9)
            lines.append(
                f"Q: If each box holds {c} {item} and there are {a} boxes, how many {item} are there?\n"
                f"A: {a} * {c} = {a * c}. The answer is {a * c}."
            )
        elif kind == 3:
            lines.append(
                rng.choice(_LATEX) + f" Also $\\frac{{{a}}}{{{b}}}$ and $\\boxed{{{a * b}}}$."
            )
        elif kind == 4:
            lines.append(rng.choice(_CODE))
        elif kind == 5:
            spaces = " " * rng.randint(2, 8)
            lines.append(
                f"{rng.choice(_ACCENTED)}{spaces}{rng.choice(_ACCENTED)}\t{a:>6}|{b:<4}|  end"
            )
        elif kind == 6:
            lines.append(f"{rng.choice(_CJK)} {rng.choice(_EMOJI)} {name} {rng.choice(_EMOJI)}")
        elif kind == 7:
            lines.append(
                f"Step {a}: compute {a} - {b} = {a - b}.\n\nStep {a + 1}: {a}/{b} ≈ {a / b:.3f}"
            )
        else:
            lines.append(
                f"{name} said, \"Let's go to {rng.choice(_PLACES)}!\" -- it's {a}% sure; "
                f"(really?) [yes] {{ok}} <tag> @{item} ~{b}"
            )
    return lines


DEFAULT_CORPUS: list[str] = build_default_corpus()
"""Built-in corpus used when a helper is called without one (deterministic)."""

# --------------------------------------------------------------------------------------
# Chat templates (deliberately different per family so chat-template tests can tell them apart)
# --------------------------------------------------------------------------------------

BPE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML (SmolLM2 / Qwen style). No BOS, matching the BPE tokenizer."""

SP_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma style. Renders ``bos_token`` itself, so encoding the rendered text with
``add_special_tokens=True`` yields a double BOS -- a real-world pitfall tests can check."""

# --------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------

_BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_SP_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
_SP_CHAT_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]
_BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]
_SP_MIN_CHAR_COUNT = 8  # characters rarer than this in the corpus get no piece of their own


# What a causal LM's tokenizer returns, as real checkpoints declare it: transformers 4.57's plain
# PreTrainedTokenizerFast would also return token_type_ids, which generate() refuses for Llama.
MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]


def train_byte_bpe_tokenizer(
    corpus: list[str] | None = None, vocab_size: int = 400
) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE tokenizer (SmolLM2 / Qwen family).

    Why this shape: byte-level BPE maps every byte to a printable symbol before merging,
    so with the full 256-symbol initial alphabet *any* string round-trips exactly, and
    leading spaces are glued onto the following word (``Ġword``) -- the property that
    makes context/continuation splitting subtle. Like GPT-2 (and Qwen, whose pad is its
    eos), ``<|endoftext|>`` is bos, eos *and* pad -- so code that strips pad ids also
    strips eos -- and no BOS is added on encode. ``<|im_start|>``/``<|im_end|>`` exist
    for the ChatML chat template.
    """
    corpus = DEFAULT_CORPUS if corpus is None else corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(_BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token=None,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        model_input_names=MODEL_INPUT_NAMES,
    )
    fast.chat_template = BPE_CHAT_TEMPLATE
    return fast


def train_sentencepiece_style_tokenizer(
    corpus: list[str] | None = None, vocab_size: int = 500
) -> PreTrainedTokenizerFast:
    """Train a SentencePiece-style BPE tokenizer with byte fallback (Llama-2 / Gemma family).

    Why this shape: it reproduces Llama-2's published ``tokenizer.json`` -- spaces become
    ``▁`` and one ``▁`` is prepended to the text (done in the normalizer, see below), BPE
    with ``byte_fallback=True`` and the 256 ``<0xNN>`` tokens at ids 3..258, a decoder of
    Replace/ByteFallback/Fuse/Strip, and a TemplateProcessing post-processor that *adds*
    ``<s>`` on encode. Characters rare or absent in training (most CJK, emoji) therefore
    encode as byte tokens and still decode exactly, and decoding a continuation on its
    own drops its leading space -- both things the backend must cope with. The merges
    are learned with a Metaspace(prepend_scheme="first") pre-tokenizer, so no piece spans
    a word boundary. Pad is a distinct ``<pad>`` and padding is on the left (as in
    ``LlamaTokenizerFast``), the opposite of the BPE family, so both cases get exercised.

    ``vocab_size`` counts everything except the chat-turn special tokens: 4 specials
    (``<unk> <s> </s> <pad>``), 256 byte tokens, and the trained pieces.
    """
    corpus = DEFAULT_CORPUS if corpus is None else corpus
    n_fixed = len(_SP_SPECIALS) + len(_BYTE_TOKENS)
    if vocab_size <= n_fixed + 64:
        raise ValueError(
            f"vocab_size must exceed {n_fixed + 64} (specials + byte tokens + some pieces)"
        )

    # 1) Learn pieces + merges on Metaspace-split words (so merges never span words).
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=True
    )
    # Rare characters are left to byte fallback, as in real SP models. The kept alphabet is
    # chosen here, not via `limit_alphabet` alone: the trainer breaks frequency ties at the
    # cut-off in hash-map order, which made the vocabulary differ from run to run.
    # Pinning it as `initial_alphabet` with `limit_alphabet=len(...)` drops exactly the rest.
    counts = Counter("".join(corpus).replace(" ", "▁"))
    alphabet = sorted(ch for ch, n in counts.items() if n >= _SP_MIN_CHAR_COUNT)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_fixed,
        min_frequency=2,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    trainer_tok.train_from_iterator(corpus, trainer=trainer)
    learned_vocab: dict[str, int] = trainer_tok.get_vocab(with_added_tokens=False)
    merges = _bpe_merges(trainer_tok)

    # 2) Re-lay the vocabulary out like Llama-2: specials, bytes, then learned pieces.
    vocab: dict[str, int] = {}
    for t in _SP_SPECIALS + _BYTE_TOKENS:
        vocab[t] = len(vocab)
    for piece, _ in sorted(learned_vocab.items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    # Llama-2's published tokenizer.json: the "▁" prefix + space replacement live in the
    # normalizer (not a Metaspace pre-tokenizer), which is what makes leading spaces
    # round-trip: " x" -> "▁▁x" -> "  x" -> Strip(1) -> " x". Metaspace(prepend_scheme=
    # "first") skips the prefix when the text already starts with a space, so Strip would
    # eat a real space.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SP_SPECIALS])
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in _SP_CHAT_SPECIALS]
    )
    bos_id = vocab["<s>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=list(_SP_CHAT_SPECIALS),
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        padding_side="left",
        model_input_names=MODEL_INPUT_NAMES,
    )
    fast.chat_template = SP_CHAT_TEMPLATE
    return fast


def _bpe_merges(tok: Tokenizer) -> list[tuple[str, str]]:
    """Extract the merge list of a trained BPE model.

    Why via JSON: ``tokenizers`` exposes no Python getter for merges; the serialized
    model is the stable public view (merges are pairs in newer versions, ``"a b"``
    strings in older ones -- both are handled).
    """
    raw = json.loads(tok.to_str())["model"]["merges"]
    out: list[tuple[str, str]] = []
    for m in raw:
        if isinstance(m, str):
            left, right = m.split(" ", 1)
            out.append((left, right))
        else:
            out.append((m[0], m[1]))
    return out
