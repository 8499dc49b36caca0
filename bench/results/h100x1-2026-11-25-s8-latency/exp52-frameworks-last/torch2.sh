#!/usr/bin/env bash
# PyTorch, two processes sharing one GPU, through the drop-in library: the peer engine off,
# then on, with each check's result printed before DDP.
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 FERROCCL_TIMEOUT=20
LIB=$PWD/.dev/libnccl.so.2
for peer in 0 16777216; do
  t0=$SECONDS
  FERROCCL_GPU_PEER_BYTES=$peer LD_PRELOAD=$LIB NCCL_DEBUG=WARN timeout 150 python3 bench/dropin/torch_nccl.py 2 > /tmp/t2-$peer.jsonl 2> /tmp/t2-$peer.err; echo "peer=$peer rc=$? $((SECONDS-t0))s"
  grep -h '"checks"' /tmp/t2-$peer.err | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); print('rank', r['rank'], 'checks_s', r['checks_s'], 'failed', [k for k, v in r['checks'].items() if not v], 'of', len(r['checks']))"
  grep -h '"ddp"' /tmp/t2-$peer.jsonl | cut -c1-200
  grep -hiE 'timed out|error' /tmp/t2-$peer.err | grep -v Warning | head -3
done
mkdir -p $OUT; cp /tmp/t2-*.err /tmp/t2-*.jsonl $OUT/ 2>/dev/null
