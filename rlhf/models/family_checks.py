"""What ``scripts/generic_survey.py`` found, per generic-path family of transformers 5.24 (2026-11-28).

The survey builds each family on a tiny random fp32 config and compares the generic path's greedy tokens
and log-probs with HF ``generate`` / forward (1e-5). ``rlhf.models.generic`` refuses the families of
``REFUSED`` (one line: what differed, or what the build-time probe found) and marks the family table with
``EQUAL`` / ``UNCHECKED``. Re-run the survey after upgrading transformers and update these.
"""

from __future__ import annotations

# equal to HF on a tiny config
EQUAL: frozenset[str] = frozenset({
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "bert", "bert-generation", "bitnet",
    "cohere", "cohere2", "cohere2_moe", "ctrl", "electra", "ernie", "ernie4_5", "ernie4_5_moe", "exaone",
    "exaone4", "exaone_moe", "flex_olmo", "flint", "gemma", "glm", "glm4", "glm4_moe", "gpt-sw3", "gpt2",
    "gpt_bigcode", "gpt_neox", "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared",
    "helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder",
    "jais2", "jetmoe", "kolibri1", "laguna", "mellum", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "opt", "persimmon", "phi", "phimoe",
    "roc_bert", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "starcoder2", "vaultgemma",
})

# refused: the generic path computed something else than HF on a tiny config, or its build-time probe
# (rlhf.rollout.generic) found attention layers the paged cache cannot hold
REFUSED: dict[str, str] = {
    "camembert": "the generic path differed from HF on a tiny config (log-probs by 8.1e-02)",
    "data2vec-text": "the generic path differed from HF on a tiny config (log-probs by 3.0e-02)",
    "diffllama": "the build-time probe refuses it: its layers make two attention calls each (differential attention)",
    "doge": "the generic path differed from HF on a tiny config (greedy tokens)",
    "dory": "the build-time probe refuses it: its layers make two attention calls each (differential attention)",
    "mimo_v2_flash": "the build-time probe refuses it: its attention layers differ in kv heads (2 and 4)",
    "roberta": "the generic path differed from HF on a tiny config (log-probs by 3.0e-02)",
    "roberta-prelayernorm": "the generic path differed from HF on a tiny config (log-probs by 7.0e-03)",
    "xlm-roberta": "the generic path differed from HF on a tiny config (log-probs by 8.1e-02)",
    "xlm-roberta-xl": "the generic path differed from HF on a tiny config (log-probs by 1.5e-01)",
}

# not checked by the survey (its shrinking does not fit the config class, or a multimodal default is too
# large for the CPU); such a family runs on the generic path with the build-time probe's checks
UNCHECKED: dict[str, str] = {
    "axk1": "survey config did not build: StrictDataclassFieldValidationError: Validation error for field 'q_lora_r...",
    "codegen": "survey config did not build: RuntimeError: The size of tensor a (16) must match the size of tensor...",
    "cohere_compass_text": "survey config did not build: KeyError: 'full_attention'",
    "cwm": "survey config did not build: StrictDataclassFieldValidationError: Validation error for field 'bos_token...",
    "dbrx": "survey config did not build: AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "deepseek_v2": "survey config did not build: RuntimeError: The size of tensor a (4) must match the size of tens...",
    "emu3": "multimodal (vq_config): its default VQ model took over 9 GB on the CPU",
    "dots1": "survey config did not build: TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'",
    "fuyu": "its config did not shrink (9408M parameters)",
    "gemma3": "multimodal (vision_config)",
    "gemma3n": "multimodal (vision_config, audio_config)",
    "gemma3n_text": "survey config did not build: ValueError: The set of layer types producing a cache is different...",
    "gemma4": "its config did not shrink (5681M parameters)",
    "gemma4_text": "survey config did not build: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer a...",
    "glm4_moe_lite": "survey config did not build: RuntimeError: The size of tensor a (4) must match the size of te...",
    "got_ocr2": "multimodal (vision_config)",
    "gptj": "survey config did not build: RuntimeError: The size of tensor a (16) must match the size of tensor b (...",
    "longcat_flash": "survey config did not build: StrictDataclassFieldValidationError: Validation error for field...",
    "minicpm3": "survey config did not build: RuntimeError: The size of tensor a (4) must match the size of tensor...",
    "mllama": "multimodal (vision_config)",
    "modernbert-decoder": "survey config did not build: StrictDataclassFieldValidationError: Validation error for f...",
    "moshi": "multimodal (depth_decoder_config)",
    "moss_transcribe_diarize": "multimodal (audio_config)",
    "phi4_multimodal": "multimodal (vision_config, audio_config)",
    "sarvam_mla": "survey config did not build: RuntimeError: The size of tensor a (4) must match the size of tenso...",
    "xmod": "survey config did not build: ValueError: Input language unknown. Please call `XmodPreTrainedModel.set_...",
    "youtu": "survey config did not build: RuntimeError: The size of tensor a (4) must match the size of tensor b (...",
    "emu3": "no survey result",
}
