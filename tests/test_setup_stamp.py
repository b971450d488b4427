"""scripts/test.sh skips the set-up only when nothing it installs from changed (scripts/setup_stamp.py)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from support import ROOT


def _stamp_module():
    spec = importlib.util.spec_from_file_location("setup_stamp", ROOT / "scripts" / "setup_stamp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("pyproject.toml", "scripts/setup.sh"):
        shutil.copy(ROOT / name, root / name)
    return root


def test_key_changes_with_pyproject_and_setup_script(tmp_path):
    stamp = _stamp_module()
    root = _copy(tmp_path)
    k0 = stamp.key(root)
    assert k0 == stamp.key(ROOT)
    with open(root / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    k1 = stamp.key(root)
    with open(root / "scripts" / "setup.sh", "a") as f:
        f.write("\n# another install\n")
    assert len({k0, k1, stamp.key(root)}) == 3


def test_current_only_after_a_completed_set_up_of_this_checkout(tmp_path):
    stamp = _stamp_module()
    env = tmp_path / "venv"
    env.mkdir()
    assert not stamp.current(ROOT, str(env))        # a fresh venv: no stamp, set it up
    stamp.write(ROOT, str(env))
    assert stamp.current(ROOT, str(env))            # this checkout's flowrt and the test packages are here
    (env / stamp.STAMP).write_text("an older set-up\n")
    assert not stamp.current(ROOT, str(env))
    other = _copy(tmp_path)                         # same files, but flowrt is installed from elsewhere
    stamp.write(other, str(env))
    assert not stamp.installed(other) and not stamp.current(other, str(env))
