# The scripts under utils/ import the package inside their functions (after setting up torch.distributed or the
# environment), so a renamed or moved name only fails when a script runs: `utils/tp_bench.py` imported
# `prefill_buckets.bench` for a session after the benchmark became a subpackage. Every such import is checked here.

import ast
import importlib
import unittest
from pathlib import Path


UTILS = Path(__file__).resolve().parents[2] / "utils"


def package_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for every `import prefill_buckets...` and `from prefill_buckets... import name`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "prefill_buckets":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "prefill_buckets"]
    return found


class UtilsImportsTest(unittest.TestCase):
    def test_every_package_import_of_the_scripts_resolves(self):
        scripts = sorted(UTILS.glob("*.py"))
        checked = 0
        for script in scripts:
            for line, module_name, name in package_imports(script):
                with self.subTest(script=script.name, line=line):
                    module = importlib.import_module(module_name)
                    if name is not None:
                        self.assertTrue(
                            hasattr(module, name) or importlib.util.find_spec(f"{module_name}.{name}") is not None,
                            f"{script.name}:{line}: `from {module_name} import {name}`: no such name",
                        )
                    checked += 1
        self.assertGreater(checked, 5)  # the scripts do import the package: the walk found them

    def test_imports_inside_functions_are_found(self):  # the positive control, on the import that broke
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "script.py"
            script.write_text("def main():\n    from prefill_buckets import bench\n", encoding="utf-8")
            self.assertEqual(package_imports(script), [(2, "prefill_buckets", "bench")])
        self.assertFalse(hasattr(importlib.import_module("prefill_buckets"), "bench"))
