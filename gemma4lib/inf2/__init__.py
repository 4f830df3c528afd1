"""Planning for inf2, computed on any machine: hardware facts, the per-core, compile-host and serving-host
plans the preflight checks, and the compile's RAM warning. The doctor (`gemma4lab.tools.doctor`), the
family tables and the rooflines (`gemma4lab.inf2`) are the lab's."""
