#!/usr/bin/env bash
# copy one run's exported drafter (split in 15 MB parts) and its records into $OUT
name=$1; d=/tmp/runs/$name
ls -la "$d" 2>&1
tar czf "$OUT/$name-meta.tgz" --exclude=checkpoint --exclude=model.safetensors -C /tmp/runs "$name" "$name.log" 2>&1
[ -f "$d/model.safetensors" ] && split -b 15000000 -d -a 1 "$d/model.safetensors" "$OUT/$name-model.part"
sha256sum "$d/model.safetensors" 2>&1; ls -la "$OUT"
