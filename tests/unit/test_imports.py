"""The package has no import circles, counting imports placed inside functions (scripts/check_imports.py)."""
import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(package_dir: Path, capsys) -> tuple[int, list[str]]:
    status = _checker().main(["check_imports.py", str(package_dir)])
    return status, capsys.readouterr().out.splitlines()


def test_the_package_has_no_import_circles(capsys):
    status, lines = _check(ROOT / "jaxmem", capsys)
    assert status == 0, "\n".join(lines)
    assert lines[0].startswith("check_imports: no import circles among ")


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "jaxmem" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "jaxmem"


def test_a_circle_through_a_function_level_import_is_found_and_printed(tmp_path, capsys):
    package = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from jaxmem.sub import b\n",
        "sub/__init__.py": "",
        "sub/b.py": "def f():\n    from ..c import g\n    return g\n",
        "c.py": "import jaxmem.a\n",
        "d.py": "from jaxmem import a\n",  # imports into the circle, is not part of it
    })
    status, lines = _check(package, capsys)
    assert status == 1
    assert lines[0] == "import circle among 3 modules: jaxmem.a, jaxmem.c, jaxmem.sub.b"
    assert lines[1] == "  e.g. jaxmem.a (a.py:1) -> jaxmem.sub.b (b.py:2) -> jaxmem.c (c.py:1) -> jaxmem.a"


def test_an_import_of_the_package_root_counts(tmp_path, capsys):
    """`from jaxmem import x` names the package's __init__ unless x is a module: a root that imports a module
    which imports a name from the root is a circle."""
    package = _package(tmp_path, {"__init__.py": "def f():\n    from jaxmem import a\n",
                                  "a.py": "from jaxmem import VERSION\n"})
    status, lines = _check(package, capsys)
    assert status == 1 and lines[0] == "import circle among 2 modules: jaxmem, jaxmem.a"


def test_a_tree_without_circles_passes(tmp_path, capsys):
    package = _package(tmp_path, {"__init__.py": "from jaxmem import a\n", "a.py": "from . import b\n",
                                  "b.py": "import os\n"})
    status, lines = _check(package, capsys)
    assert status == 0, lines
    assert lines == ["check_imports: no import circles among 3 modules (2 imports, function-level included)"]


def test_the_package_floors_hold_and_lazy_imports_say_why(capsys):
    """No package imports one on a higher floor (or another feature package), none is allowed to, and the
    package's function-level imports (at most 6, the tree's count: a new one is a decision, raise it here with
    its reason) each carry their reason."""
    checker = _checker()
    status, lines = _check(ROOT / "jaxmem", capsys)
    assert status == 0, "\n".join(lines)
    assert lines[1].startswith("check_imports: the package floors hold (")
    assert checker.UP_ALLOWED == {}
    graph, known = checker.import_graph(ROOT / "jaxmem")
    assert checker.count_lazy_imports(ROOT / "jaxmem", known) <= 6


def test_an_import_up_the_floors_or_across_features_is_named(tmp_path, capsys):
    package = _package(tmp_path, {
        "__init__.py": "", "config/__init__.py": "", "config/schema.py": "from jaxmem.core import program\n",
        "core/__init__.py": "", "core/program.py": "import os\n",
        "lora/__init__.py": "", "lora/plugin.py": "from jaxmem.moe import bill\n",
        "moe/__init__.py": "", "moe/bill.py": "def f():\n    from jaxmem.core import program\n    return program\n",
    })
    status, lines = _check(package, capsys)
    assert status == 1
    assert lines == ["jaxmem.config.schema (schema.py:1) imports jaxmem.core.program: floor 7 > 0",
                     "jaxmem.lora.plugin (plugin.py:1) imports jaxmem.moe.bill: a feature on the same floor",
                     "jaxmem.moe.bill (bill.py:2): a function-level import without its reason"]


def test_the_planner_importing_a_feature_package_is_named(tmp_path, capsys):
    """plan/ sits above the features yet imports none of them (nor does core/): it calls the features' hooks."""
    package = _package(tmp_path, {
        "__init__.py": "", "moe/__init__.py": "", "moe/bill.py": "import os\n",
        "plan/__init__.py": "", "plan/costmodel.py": "import os\nfrom jaxmem.moe import bill\n",
        "registry.py": "from jaxmem.moe import bill\n",  # the registry may
    })
    status, lines = _check(package, capsys)
    assert status == 1
    assert lines == ["jaxmem.plan.costmodel (costmodel.py:2) imports jaxmem.moe.bill: plan/ imports no feature "
                     "package (ask the registry's features for a hook)"]
