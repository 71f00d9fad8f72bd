#!/usr/bin/env bash
# Prints the folder holding libnccl.so.2 on the GPU machine, where NCCL exists
# only inside the PyTorch wheels (nvidia-nccl-cu*); exits 1 when there is none.
# Used by gpu-run.sh (bundled beside it as run.sh) and gpu-dist.sh.
python3 - <<'PY' 2>/dev/null
import glob, os, site
try:
    import nvidia.nccl as m
    d = os.path.join(list(m.__path__)[0], "lib")
    if os.path.exists(os.path.join(d, "libnccl.so.2")):
        print(d); raise SystemExit
except ImportError:
    pass
for s in site.getsitepackages():
    for f in sorted(glob.glob(s + "/nvidia/**/libnccl.so.2", recursive=True)):
        print(os.path.dirname(f)); raise SystemExit
raise SystemExit(1)
PY
