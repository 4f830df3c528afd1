"""The Neuron recipes: thin adapters that hand the device graph to a Neuron compiler.

- `model_builder` (`neuron_model_builder`): every variant at every TP degree, E2B at TP=1 included;
  NxD `ModelBuilder` v1, a prefill key per bucket and a decode key over one set of aliased K/V states, the
  rank as an `SPMDRank` tensor.
- `trace` (`neuron_trace`): TP=1 on request (`PortSettings.neuron_recipe="trace"`), the simplest
  lesson; `torch_neuronx.trace` of the decode graph with the K/V as aliased state, the prompt
  prefilled through it one token per device step.

Beside either, with images: `neuron_vision`, the vision graph traced (`torch_neuronx.trace`) for one
NeuronCore, rank 0's, its own artifact (not a decoder recipe: it holds no K/V).

`memory_plan.neuron_recipe(variant, tp, requested)` picks one. NxD's `parallel_model_trace` (one process per
rank) is unsupported since SDK 2.27, so no recipe uses it: ModelBuilder compiles one rank in one
process at every TP degree. Hand-driven TP stays what the E4B notebook teaches on CPU (gloo ranks).

Importing any of them never imports the Neuron SDK (targets SDK 2.28, see `neuron_env`); calling
a Neuron-only entry point without it raises `NeuronSDKMissingError` saying what to install. The
host loops, the modules handed to the compilers and the sharded data paths all run on CPU.
"""

# the one list of inf2 recipes (`memory_plan.NEURON_RECIPES` is its names; a variant's default is `Variant.recipe`)
RECIPE_MODULES = {"model_builder": "gemma4lib.recipes.neuron_model_builder", "trace": "gemma4lib.recipes.neuron_trace"}

# Neuron-only entry points per module (each raises NeuronSDKMissingError without the SDK)
NEURON_ENTRY_POINTS = {
    "gemma4lib.recipes.neuron_trace": ("compile_trace", "load"),
    "gemma4lib.recipes.neuron_model_builder": ("compile_model_builder", "load_model_builder", "NxDParallelFactory"),
}
