"""transformers' lazy import table, built once per test run instead of once per process.

`import transformers` reads every source file under transformers/models (3,344 of them in 5.24) to build the table
its lazy modules resolve names from (`utils.import_utils.create_import_structure_from_path`): about 1.1 s of CPU
in each of the ~270 Python processes the suite starts (daemons, CLI runs, isolated calls), since mlx-lm's
tokenizer wrapper imports it. The table is a function of those files alone; the suite's children keep the one
the first of them built, under $TESTS_TRANSFORMERS_TABLE (the run's own directory, set by tests/conftest.py).
transformers' code runs as ever; only that walk is memoized. Without the variable nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.util
import os
import pickle
import sys
import threading
from pathlib import Path

MODULE = "transformers.utils.import_utils"
_building = threading.local()


def _memoized(module, directory: Path) -> None:
    walk = module.create_import_structure_from_path
    version = getattr(sys.modules.get("transformers"), "__version__", "?")

    def create_import_structure_from_path(module_path):
        if getattr(_building, "on", False):  # its own recursion into subfolders: one table per top-level call
            return walk(module_path)
        table = directory / (hashlib.sha256(f"{version} {module_path}".encode()).hexdigest()[:24] + ".pickle")
        try:
            kept_for, result = pickle.loads(table.read_bytes())  # written by this run's own processes, below
            if kept_for == str(module_path):
                return result
        except Exception:  # missing, half-written by a killed process, or not ours: walk as transformers does
            pass
        _building.on = True
        try:
            result = walk(module_path)
        finally:
            _building.on = False
        partial = table.with_name(f"{table.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:  # best effort: a full disk or a removed run directory must not fail the import
            partial.write_bytes(pickle.dumps((str(module_path), result)))
            os.replace(partial, table)
        except OSError:
            with contextlib.suppress(OSError):
                partial.unlink()
        return result

    module.create_import_structure_from_path = functools.lru_cache(create_import_structure_from_path)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, directory: Path):
        self.directory = directory

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            if callable(getattr(module, "create_import_structure_from_path", None)):
                _memoized(module, self.directory)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    where = os.environ.get("TESTS_TRANSFORMERS_TABLE")
    if where and MODULE not in sys.modules:
        try:
            Path(where).mkdir(parents=True, exist_ok=True)
        except OSError:  # no run directory to share: transformers walks its files, as ever
            return
        sys.meta_path.insert(0, _AfterImport(Path(where)))
