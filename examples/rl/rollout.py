"""The rollout side of examples/rl/run_rl_demo.sh: one process, a transformers model that takes each new policy
version (the first whole, the next ones through the deltas) and generates a few tokens with it; from the versions'
directory on this node, or over TCP from a relay on the trainer's node (a reader on another node).

    python examples/rl/rollout.py VERSIONS_DIR NAME LAST_ITERATION
    python examples/rl/rollout.py --relay HOST:PORT NAME LAST_ITERATION
"""
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from datastates.weights import RemoteReader, WeightsError, WeightsReader

if sys.argv[1] == "--relay":
    host, port = sys.argv[2].rsplit(":", 1)
    reader, (name, last) = RemoteReader(host, int(port), timeout_s=600), sys.argv[3:5]
else:
    reader, (name, last) = WeightsReader(sys.argv[1]), sys.argv[2:4]
last = int(last)
prompt = torch.tensor([[1, 2, 3, 4]])
model, held = None, None
while held != last:
    how = "deltas"
    try:
        if model is None:
            raise WeightsError("no model yet")
        if isinstance(reader, RemoteReader):  # the relay waits for a newer one, then sends its deltas (or it whole)
            how = "caught up through the relay"
            held, nbytes = reader.catch_up(dict(model.named_parameters()), held, timeout_s=600)
        else:
            with reader.wait_next(held, timeout_s=600) as version:  # a newer one is there; reach it through deltas
                pass
            held, nbytes = reader.catch_up(dict(model.named_parameters()), held)
    except WeightsError:  # the first version, or a chain of deltas that is gone: the whole version
        how = "whole"
        with reader.wait_next(held, timeout_s=600) as version:
            if model is None:
                config = AutoConfig.for_model(**version.config)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            version.load_into(model)
            held, nbytes = version.iteration, version.nbytes
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    print(f"rollout {name}: policy version {held} ({how}, {nbytes} bytes read{' on the wire' if isinstance(reader, RemoteReader) else ''}) -> tokens {tokens}", flush=True)
