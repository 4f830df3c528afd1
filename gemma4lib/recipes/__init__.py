"""The Neuron recipes: thin adapters that hand the device graph to a Neuron compiler.

- `model_builder` (`neuron_model_builder`): every variant at every TP degree; NxD `ModelBuilder` v1,
  a prefill key per bucket and a decode key over one set of aliased K/V states, the rank an
  `SPMDRank` tensor. (NxD's `parallel_model_trace` is unsupported since SDK 2.27.)
- `trace` (`neuron_trace`): TP=1 on request, the simplest lesson: `torch_neuronx.trace` of the decode
  graph with aliased K/V, the prompt prefilled through it one token per device step.
- `neuron_vision`: with images, the vision graph traced for rank 0's NeuronCore (no K/V).

`memory_plan.neuron_recipe` picks one. Importing them never imports the Neuron SDK (SDK 2.28,
`neuron_env`): a Neuron-only call without it raises `NeuronSDKMissingError` saying what to install.
The host loops, the modules handed to the compilers and the sharded data paths all run on CPU.
"""

# the one list of inf2 recipes (`memory_plan.NEURON_RECIPES` is its names; a variant's default is `Variant.recipe`)
RECIPE_MODULES = {"model_builder": "gemma4lib.recipes.neuron_model_builder", "trace": "gemma4lib.recipes.neuron_trace"}
