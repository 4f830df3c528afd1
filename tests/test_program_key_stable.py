"""A compiled graph's cache key is the same in every process: a notebook kernel reuses what a test compiled.

transformers orders the RoPE tables by a set of layer-type strings, whose order follows the hash
seed of the process (`DeviceGraph` sorts it): with it unsorted, two processes exported two programs
for one graph, and the artifact cache compiled it twice.
"""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import torch
torch.set_num_threads(1)
from gemma4lib.backends.program_key import program_digest
from gemma4lib.backends.compile_cpu import export_graph
from gemma4lib.device.build import device_graphs
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import get_variant
from gemma4lib.port import PortSettings
model = build_tiny(get_variant("e2b"), seed=0)
_, decode = device_graphs(model, PortSettings(variant="e2b", model="random"))
print(program_digest(export_graph(decode)))
"""


def digest_with_hash_seed(seed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def test_the_program_digest_does_not_follow_the_hash_seed():
    # seeds 0 and 1 ordered {"full_attention", "sliding_attention"} differently before the sort
    first, second = digest_with_hash_seed(0), digest_with_hash_seed(1)
    assert len(first) == 64 and first == second
