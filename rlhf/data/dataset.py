"""Prompt datasets in verl's schema (parquet or jsonl), tokenised once at load time.

A row looks like verl's preprocessed GSM8K::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],      # or a plain string
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

The ground truth may also be a top-level ``ground_truth`` or ``answer`` column (a GSM8K
style ``answer`` holding a worked solution keeps only what follows its last ``####``).

Bad rows are skipped and counted, never silently: :class:`DatasetStats` says how many and
why (first few reasons, with row numbers). A file in which no row is usable, a missing
file, or an unsupported extension raises :class:`DataError` naming the file and the
first problem. Every rank loads the same files and gets the same example order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import pyarrow.parquet as pq

from rlhf.data.multimodal import decode_image, expand_placeholders, image_tokens_kept, process_images

Truncation = Literal["error", "left", "right", "middle"]
_TRUNCATIONS = ("error", "left", "right", "middle")
_MAX_REASONS = 5
_ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A dataset file cannot be used; the message names the file and the problem."""


@dataclass
class PromptExample:
    """One tokenised prompt.

    ``prompt_ids`` is ``[T_prompt]`` (chat template already applied, generation prompt
    appended); ``index`` is the position in the dataset (after filtering).
    """

    index: int
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any]
    multi_modal: dict | None = None  # images of a VLM prompt (rlhf.data.multimodal.MultiModalInputs)


@dataclass
class DatasetStats:
    """What happened to the rows of the input files."""

    n_rows: int = 0
    n_loaded: int = 0
    n_malformed: int = 0
    n_too_long: int = 0
    n_truncated: int = 0
    n_image_cut: int = 0  # multimodal prompts over max_prompt_length whose truncation would cut image tokens
    malformed_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        s = (
            f"{self.n_loaded}/{self.n_rows} rows loaded; {self.n_malformed} malformed, "
            f"{self.n_too_long} too long (filtered), {self.n_truncated} truncated"
        )
        if self.n_image_cut:
            s += f", {self.n_image_cut} filtered (truncation would cut image tokens)"
        if self.malformed_examples:
            s += "; e.g. " + " | ".join(self.malformed_examples)
        return s


@dataclass
class PromptDataset:
    """Tokenised prompts plus loading statistics."""

    examples: list[PromptExample]
    stats: DatasetStats

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def select(self, indices: Sequence[int]) -> list[PromptExample]:
        """The examples at ``indices`` (e.g. one batch from :class:`PromptLoader`)."""
        return [self.examples[i] for i in indices]


class _BadRow(Exception):
    """Internal: a row that is skipped and counted."""


def read_rows(path: Path) -> tuple[list[Any], list[tuple[int, str]]]:
    """Rows of one file (parquet or jsonl), plus (row number, reason) for lines that are not
    valid JSON; those rows are ``None`` so that row numbers stay aligned with the file."""
    if not path.exists():
        raise DataError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist(), []
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: cannot read parquet: {e}") from e
    if suffix in (".jsonl", ".json"):
        rows: list[Any] = []
        bad: list[tuple[int, str]] = []
        with path.open("rb") as f:  # bytes: a line that is not UTF-8 is one bad row, not the end of the file
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad.append((len(rows), f"line {lineno}: not UTF-8 ({e.reason} at byte {e.start})"))
                    rows.append(None)
                    continue
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    bad.append((len(rows), f"line {lineno}: invalid JSON ({e.msg})"))
                    rows.append(None)  # keeps row numbers aligned with lines
        return rows, bad
    raise DataError(f"{path}: unsupported dataset extension '{path.suffix}'; expected .parquet or .jsonl")


def _check_messages(prompt: list[Any]) -> list[dict[str, str]]:
    if not prompt:
        raise _BadRow("prompt is an empty list")
    msgs = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise _BadRow(f"prompt[{j}] is not a {{'role': str, 'content': str}} message")
        if m["role"] not in _ROLES:
            raise _BadRow(f"prompt[{j}] has unknown role '{m['role']}'; expected one of {list(_ROLES)}")
        msgs.append({"role": m["role"], "content": m["content"]})
    return msgs


def _ground_truth(row: dict[str, Any]) -> str:
    rm = row.get("reward_model")
    gt: Any = rm.get("ground_truth") if isinstance(rm, dict) else None
    if gt is None:
        gt = row.get("ground_truth")
    if gt is None and row.get("answer") is not None:
        gt = row["answer"]
        if isinstance(gt, str) and "####" in gt:
            gt = gt.rsplit("####", 1)[1].strip().replace(",", "")
    if gt is None:
        raise _BadRow("missing ground truth (reward_model.ground_truth, ground_truth or answer)")
    if isinstance(gt, float) and not math.isfinite(gt):
        raise _BadRow(f"ground truth is {gt}")
    if isinstance(gt, (list, dict)):
        # verl's math datasets sometimes store a list of accepted answers; reward functions
        # that expect it get it JSON-encoded and can decode it.
        return json.dumps(gt)
    return str(gt)


def _parse_row(row: Any, prompt_key: str) -> tuple[list[dict[str, str]] | str, str, str, dict[str, Any]]:
    if not isinstance(row, dict):
        raise _BadRow(f"row is a {type(row).__name__}, not an object")
    if prompt_key not in row or row[prompt_key] is None:
        raise _BadRow(f"missing '{prompt_key}'")
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt:
            raise _BadRow(f"'{prompt_key}' is an empty string")
    elif isinstance(prompt, list):
        prompt = _check_messages(prompt)
    else:
        raise _BadRow(f"'{prompt_key}' is a {type(prompt).__name__}; expected a list of messages or a string")
    gt = _ground_truth(row)
    data_source = row.get("data_source") or "unknown"
    if not isinstance(data_source, str):
        raise _BadRow(f"data_source is a {type(data_source).__name__}, not a string")
    extra = row.get("extra_info")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise _BadRow(f"extra_info is a {type(extra).__name__}, not an object")
    return prompt, gt, data_source, extra


def _render(prompt: list[dict[str, str]] | str, tokenizer: Any, use_template: bool, tools: list | None = None) -> str:
    if use_template:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, tools=tools)
    if isinstance(prompt, str):
        return prompt
    # No template to apply: the message contents joined, as a plain-text prompt.
    return "\n".join(m["content"] for m in prompt)


def _truncate(ids: list[int], max_len: int, truncation: str) -> list[int]:
    if truncation == "middle":  # verl: the first max//2 tokens and the last max - max//2
        half = max_len // 2
        return ids[:half] + ids[len(ids) - (max_len - half):]
    return ids[-max_len:] if truncation == "left" else ids[:max_len]


def _image_token_ids(processor: Any) -> set[int]:
    """Ids of the tokens an image expands to (the pad and its start / end markers)."""
    if processor is None:
        return set()
    tok = processor.tokenizer
    names = ("<|vision_start|>", "<|vision_end|>", getattr(processor, "image_token", "<|image_pad|>"))
    return {i for i in (tok.convert_tokens_to_ids(n) for n in names) if i is not None and i != tok.unk_token_id}


def _process_multimodal(processor: Any, path: Path, rows: list, parsed: list, texts: list, all_ids: list,
                        mm_rows: dict, image_key: str) -> tuple[list[int], list[str]]:
    """Run the processor on the rows that hold images (their text and ids replaced in place, their
    inputs put in ``mm_rows`` by row number); returns the positions in ``parsed`` that are usable,
    and a problem for each row whose images are unreadable or do not match its placeholders."""
    keep, problems = [], []
    for j, (r, *_) in enumerate(parsed):
        images = rows[r].get(image_key) if isinstance(rows[r], dict) else None
        if not images:
            keep.append(j)
            continue
        try:
            pics = [decode_image(x, path.parent) for x in images]
            text = expand_placeholders(texts[j], len(pics))
        except ValueError as e:
            problems.append(f"{path.name} row {r}: {image_key}: {e}")
            continue
        texts[j] = text
        all_ids[j], mm_rows[r] = process_images(processor, text, pics)
        keep.append(j)
    return keep, problems


def load_prompt_dataset(
    path_or_paths: str | Path | Sequence[str | Path],
    tokenizer: Any,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int = 512,
    truncation: Truncation = "error",
    filter_overlong_prompts: bool = True,
    apply_chat_template: bool = True,
    tools: list | None = None,
    processor: Any = None,
    image_key: str = "images",
) -> PromptDataset:
    """Load and tokenise prompt files (parquet / jsonl in verl's schema), concatenated.

    Args:
        path_or_paths: one file or a list of files; examples keep file order then row order.
        tokenizer: a HF tokenizer. Its chat template is applied (with the generation
            prompt) when it has one and ``apply_chat_template``; a string prompt is then
            wrapped as one user message. Otherwise the raw text is tokenised with the
            tokenizer's special tokens (e.g. BOS).
        prompt_key: column holding the prompt (verl: ``data.prompt_key``).
        max_prompt_length: longest prompt in tokens (verl: ``data.max_prompt_length``).
        truncation: for over-long prompts when not filtered: ``"error"`` raises naming the
            row, ``"left"`` keeps the last tokens, ``"right"`` the first, ``"middle"`` both ends
            (the first ``max // 2`` and the last ``max - max // 2``; verl: ``data.truncation``).
        filter_overlong_prompts: drop and count over-long prompts (verl: ``data.filter_overlong_prompts``).
        apply_chat_template: set False to tokenise raw text even if a template exists.
        tools: OpenAI function schemas the chat template lists (multi-turn tool use).
        processor: a vision-language model's processor (``AutoProcessor``). Rows with a non-empty
            ``image_key`` column then have one ``<image>`` placeholder per image; the processor
            expands them and the row keeps its ``pixel_values`` / ``image_grid_thw``
            (``PromptExample.multi_modal``). Such a prompt over ``max_prompt_length`` is truncated
            only where no image token is cut; otherwise it is filtered and counted
            (``stats.n_image_cut``), never cut.
        image_key: the images column (verl: ``data.image_key``).

    Returns:
        A :class:`PromptDataset`; ``stats`` counts rows, malformed, filtered, truncated.

    Raises:
        DataError: a file is missing / unreadable / of an unsupported type, a file has no
            usable row, or an over-long prompt with ``truncation="error"``.
    """
    if truncation not in _TRUNCATIONS:
        raise ValueError(f"truncation must be one of {list(_TRUNCATIONS)}, got '{truncation}'")
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be > 0, got {max_prompt_length}")
    paths = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    if not paths:
        raise DataError("no dataset files given")
    use_template = apply_chat_template and getattr(tokenizer, "chat_template", None) is not None

    stats = DatasetStats()
    examples: list[PromptExample] = []
    for raw_path in paths:
        path = Path(raw_path)
        rows, bad_json = read_rows(path)
        stats.n_rows += len(rows)
        problems: list[tuple[int, str]] = [(r, f"{path.name} row {r}: {reason}") for r, reason in bad_json]
        bad_rows = {r for r, _ in bad_json}

        parsed: list[tuple[int, list[dict[str, str]] | str, str, str, dict[str, Any]]] = []
        for r, row in enumerate(rows):
            if r in bad_rows:
                continue
            try:
                parsed.append((r, *_parse_row(row, prompt_key)))
            except _BadRow as e:
                problems.append((r, f"{path.name} row {r}: {e}"))
        problems.sort()
        stats.n_malformed += len(problems)
        room = max(0, _MAX_REASONS - len(stats.malformed_examples))
        stats.malformed_examples.extend(msg for _, msg in problems[:room])
        if rows and not parsed:
            raise DataError(f"{path}: none of its {len(rows)} rows is usable; first problem: {problems[0][1]}")
        if not rows:
            raise DataError(f"{path}: the file has no rows")

        texts = [_render(p, tokenizer, use_template, tools) for _, p, *_ in parsed]
        # Batched call: fast tokenizers encode the whole file in parallel.
        all_ids = tokenizer(texts, add_special_tokens=not use_template)["input_ids"]
        mm_rows: dict[int, dict] = {}
        if processor is not None:
            keep, bad = _process_multimodal(processor, path, rows, parsed, texts, all_ids, mm_rows, image_key)
            stats.n_malformed += len(bad)
            room = max(0, _MAX_REASONS - len(stats.malformed_examples))
            stats.malformed_examples.extend(bad[:room])
            parsed, texts, all_ids = ([x[i] for i in keep] for x in (parsed, texts, all_ids))
        image_ids = _image_token_ids(processor)
        for (r, _, gt, source, extra), text, ids in zip(parsed, texts, all_ids):
            ids = list(ids)
            mm = mm_rows.get(r)
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    stats.n_too_long += 1
                    continue
                if mm is not None and truncation != "error" and not image_tokens_kept(
                        ids, _truncate(ids, max_prompt_length, truncation), image_ids):
                    stats.n_image_cut += 1
                    continue
                if truncation == "error":
                    raise DataError(
                        f"{path} row {r}: prompt has {len(ids)} tokens > max_prompt_length="
                        f"{max_prompt_length}; raise max_prompt_length, set filter_overlong_prompts=True, "
                        f"or truncation='left'/'right'"
                    )
                ids = _truncate(ids, max_prompt_length, truncation)
                text = tokenizer.decode(ids, skip_special_tokens=False)
                stats.n_truncated += 1
            examples.append(PromptExample(len(examples), ids, text, gt, source, extra, mm))

    stats.n_loaded = len(examples)
    if not examples:
        raise DataError(
            f"no prompt left from {[str(p) for p in paths]}: {stats.n_too_long} longer than "
            f"max_prompt_length={max_prompt_length}, {stats.n_malformed} malformed"
        )
    return PromptDataset(examples, stats)
