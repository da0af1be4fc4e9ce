# Sourced on a lent GPU machine: the target's GGUF put together from the parts earlier calls left in
# /tmp/g (each call moves the part it carried there; see benchmarks/device/prepare.sh), checked
# against its sha256, and the environment that runs verispec from the carried tree with .gpu/site's
# packages and a cache in /tmp/vcache (the first command converts the GGUF there, once).
mkdir -p /tmp/g /tmp/vcache/gguf
for f in .gpu/p? .gpu/sha256; do [ -f "$f" ] && mv "$f" /tmp/g/; done
[ -d /tmp/site ] || cp -r .gpu/site /tmp/site
target=/tmp/vcache/gguf/gemma-3-270m-q4_k_m.gguf
if [ ! -f "$target" ]; then
    missing=$(for i in 0 1 2 3 4; do [ -f /tmp/g/p$i ] || echo -n "p$i "; done)
    [ -z "$missing" ] || { echo "target parts missing: $missing(carry each .gpu/pN in its own call first)"; exit 3; }
    cat /tmp/g/p0 /tmp/g/p1 /tmp/g/p2 /tmp/g/p3 /tmp/g/p4 > "$target"
    echo "$(cat /tmp/g/sha256)  $target" | sha256sum -c || { rm -f "$target"; exit 3; }
fi
export VERISPEC_CACHE=/tmp/vcache PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
