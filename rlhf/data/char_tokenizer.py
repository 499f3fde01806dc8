"""A character-level tokenizer for the synthetic quickstart task.

Why: the quickstart trains a tiny model from scratch on CPU, so it needs a tokenizer that
exists without the HF hub and whose vocabulary is a few dozen ids. Every character is one
token, which also makes the arithmetic task learnable by a 2-layer model (one digit = one
position). The result is an ordinary ``PreTrainedTokenizerFast`` with a chat template, so
the rest of the project treats it exactly like a real model's tokenizer and it
round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"

# Order fixes the ids: pad=0, eos=1, unk=2, user=3, assistant=4, system=5.
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    EOS_TOKEN,
    UNK_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    SYSTEM_TOKEN,
)

DEFAULT_CHARS: str = (
    "0123456789"
    "abcdefghijklmnopqrstuvwxyz"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n"
    "+-*/=#;,.?:()!'\"$%<>_[]{}|&@^~`\\"
)

# Compact on purpose: a char-level model pays one position per template character.
# "<|user|>47+38=<|assistant|>7+8=15;4+3+1=8 #### 85<eos>"; a tool result (multi-turn) is a user
# turn "<|user|><tool_response>85</tool_response>", as in Qwen's template.
CHAT_TEMPLATE: str = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ '<|system|>' + message['content'] }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '<|user|>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>' + message['content'] + '<eos>' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|user|><tool_response>' + message['content'] + '</tool_response>' }}"
    "{%- else -%}"
    "{{ raise_exception('unknown chat role ' + message['role'] + "
    "'; expected system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def build_char_tokenizer(chars: str | None = None) -> PreTrainedTokenizerFast:
    """Build a character-level fast tokenizer.

    Args:
        chars: the characters in the vocabulary (duplicates ignored, order kept). Defaults
            to digits, ASCII letters, space, newline and common punctuation.

    Returns:
        A ``PreTrainedTokenizerFast`` with ``pad_token``/``eos_token``/``unk_token`` set,
        single-id special tokens ``<|user|>``, ``<|assistant|>``, ``<|system|>``, and a
        chat template where an assistant turn ends with ``<eos>`` and
        ``add_generation_prompt`` appends ``<|assistant|>``. Characters outside the
        vocabulary encode to ``<unk>``.
    """
    chars = DEFAULT_CHARS if chars is None else chars
    unique_chars = list(dict.fromkeys(chars))
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in unique_chars:
        if ch not in vocab:
            vocab[ch] = len(vocab)

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # `[\s\S]` (not `.`) so newlines are split off as characters too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the pieces with no separator, so decode(encode(s)) == s.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        chat_template=CHAT_TEMPLATE,
        # The default cleanup would turn " ." into "." and break the round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
