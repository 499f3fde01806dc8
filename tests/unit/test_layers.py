"""The package's import contracts (.importlinter): layers that import only downward, no import
circles, pure layers that import nothing above them. The same check as `lint-imports` in CI, so
a local `pytest` fails on an upward import too. The layers are described in docs/architecture.md.
"""

from pathlib import Path

from importlinter.application.use_cases import lint_imports
from importlinter.configuration import configure

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_kept():
    configure()  # what the lint-imports command does first: the ini reader, the graph builder
    # Prints the report (captured by pytest, shown on failure): the broken contract and the import chain.
    assert lint_imports(config_filename=str(ROOT / ".importlinter"), cache_dir=None, no_logo=True), \
        "an import breaks a contract of .importlinter (see the report above and docs/architecture.md)"


def test_every_top_level_module_is_in_a_layer():
    # `exhaustive = true` makes lint-imports fail for an unlisted module; this names the rule here too.
    text = (ROOT / ".importlinter").read_text()
    assert "exhaustive = true" in text
    layers = text.split("layers =", 1)[1].split("\n[", 1)[0]
    listed = {name.strip() for line in layers.splitlines() if not line.strip().startswith("#")
              for name in line.split("|") if name.strip()}
    pkg = ROOT / "rlhf"
    children = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    children |= {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    assert children == listed
