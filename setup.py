from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec((Path(__file__).parent / "rlhf" / "__init__.py").read_text(), version)

setup(
    name="rlhf",
    version=version["__version__"],
    description="RL post-training (PPO, GRPO, DAPO, ...) of causal LMs in plain PyTorch with torchrun",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["rlhf", "rlhf.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "transformers>=4.51",
        "peft>=0.15",
        "pyyaml",
        "numpy",
        "pyarrow",
    ],
    extras_require={
        # The logger tests write with tensorboard, mlflow (sqlite store) and wandb (offline) and read the values back;
        # import-linter checks the package's layers (.importlinter; lint-imports, tests/unit/test_layers.py);
        # pytest-xdist runs the suite on every core (most tests wait on subprocesses part of the time);
        # Pillow decodes the images of the vision-language tests.
        "test": ["pytest", "pytest-xdist", "matplotlib", "math-verify", "tensorboard", "mlflow-skinny", "sqlalchemy", "alembic", "wandb",
                 "import-linter", "pillow"],
        "gpu": ["flash-attn"],
        # actor.fp8: torchao's float8 training (convert_to_float8_training, FP8 all-gather under FSDP2); FP8
        # rollout (rollout.quantization: fp8) needs nothing beyond torch.
        "fp8": ["torchao>=0.12"],
        # Vision-language models (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): images are decoded with Pillow.
        "vlm": ["pillow"],
        "log": ["tensorboard", "mlflow"],
        "math": ["math-verify"],
        # The documentation site (mkdocs.yml; `mkdocs build --strict`, run by .ci/run).
        "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10"],
    },
)
