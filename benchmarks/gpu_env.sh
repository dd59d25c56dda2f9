# Source this on a GPU machine that has PyTorch but not hyperfed's small pure-Python deps:
# installs wheels carried in .whl/ (pydantic and its three deps) and puts the repo on the path.
# Data: copy the four Fashion-MNIST .gz files into data/fashion_mnist/ (git-ignored).
set -o pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HYPERFED_DATA=$PWD/data
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -c "from hyperfed.cli import app; app()" "$@"\n' >/tmp/bin/hyperfed
chmod +x /tmp/bin/hyperfed && export PATH=/tmp/bin:$PATH
