"""The tutorial's stages, importable by plain names.

Folder names start with digits (they give the reading order), so Python cannot
import them directly. This package maps plain names to the numbered folders:

    from stages import naive, flash_v1, flash_v2, flash_v2_backward, ring, train_gpt
    import stages.flash_v2          # works too

Each numbered folder is an ordinary package (it has an ``__init__.py``); only its
name is translated. Nothing is copied and nothing is imported until asked for.
"""
import importlib.abc
import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# plain name -> numbered folder, in reading order
STAGES = {
    "naive": "00_naive",
    "flash_v1": "01_flash_v1",
    "flash_v2": "02_flash_v2",
    "flash_v2_backward": "03_flash_v2_backward",
    "ring": "04_ring",
    "train_gpt": "05_train_gpt",
    "hopper": "06_hopper",
}


class _StageFinder(importlib.abc.MetaPathFinder):
    """Finds ``stages.<plain name>`` in the numbered folder it names."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in STAGES:
            return None
        folder = _HERE / STAGES[name]
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


if not any(isinstance(f, _StageFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StageFinder())


def __getattr__(name):
    # `from stages import flash_v1` and `stages.flash_v1` both land here.
    if name in STAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'stages' has no attribute {name!r}; stages are {sorted(STAGES)}")
