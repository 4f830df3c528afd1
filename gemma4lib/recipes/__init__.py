"""The Neuron recipes: thin adapters that hand the device graph to a Neuron compiler.

| recipe          | module                  | variants              | compiler API                              |
|-----------------|-------------------------|-----------------------|-------------------------------------------|
| `trace`         | `neuron_trace`          | E2B (TP=1)            | `torch_neuronx.trace` + K/V aliases       |
| `tp_alias`      | `neuron_tp_alias`       | E4B (TP=2)            | NxD `parallel_model_trace`, CPU-seeded prefill |
| `model_builder` | `neuron_model_builder`  | 12B, 31B, 26B-A4B     | NxD `ModelBuilder` v1, `SPMDRank`         |

Importing any of them never imports the Neuron SDK (targets SDK 2.28, see `neuron_env`); calling
a Neuron-only entry point without it raises `NeuronSDKMissingError` saying what to install. The
host loops, the modules handed to the compilers and the sharded data paths all run on CPU.
"""

RECIPE_MODULES = {
    "trace": "gemma4lib.recipes.neuron_trace",
    "tp_alias": "gemma4lib.recipes.neuron_tp_alias",
    "model_builder": "gemma4lib.recipes.neuron_model_builder",
}

# Neuron-only entry points per module (each raises NeuronSDKMissingError without the SDK)
NEURON_ENTRY_POINTS = {
    "gemma4lib.recipes.neuron_trace": ("compile_trace", "load"),
    "gemma4lib.recipes.neuron_tp_alias": ("compile_tp_alias", "load_tp_alias", "seed_device_kv"),
    "gemma4lib.recipes.neuron_model_builder": ("compile_model_builder", "load_model_builder", "NxDParallelFactory"),
}
