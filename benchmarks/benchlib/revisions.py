"""Another git revision's pass in this process, beside this checkout's: its package extracted with ``git archive``
and imported under another name (an arm's ``"revision"`` in ``paired.py``). Where the checkout has no git history (a
copy of the working tree, as on the device machine), ``.rev/<rev>.tar`` is read instead: made beforehand with
``git archive -o .rev/<rev>.tar <rev> thunder_fp8shard`` (``.rev/`` is ignored; carry it)."""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
import tarfile

from benchlib import ROOT

OTHER = "thunder_fp8shard_rev"


def import_revision(rev: str, into: str):
    """The pass package of git revision ``rev``, extracted under ``into`` and imported as ``thunder_fp8shard_rev``
    (its imports, executor and operator names renamed, so that both versions coexist in one process)."""
    saved = os.path.join(ROOT, ".rev", f"{rev}.tar")
    if os.path.exists(saved):
        with open(saved, "rb") as f:
            archive = f.read()
    else:
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "thunder_fp8shard"], check=True,
                                 capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            path = os.path.join(into, OTHER, os.path.relpath(member.name, "thunder_fp8shard"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            text = tar.extractfile(member).read().decode()
            if member.name.endswith(".py"):
                text = re.sub(r"\bthunder_fp8shard\b", OTHER, text).replace('"fp8shard', '"fp8shard_rev')
            with open(path, "w") as f:
                f.write(text)
    sys.path.insert(0, into)
    return importlib.import_module(OTHER)
