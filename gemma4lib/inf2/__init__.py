"""Planning for inf2, computed on any machine: hardware facts, the per-core, compile-host and serving-host
plans the preflight checks, and the doctor. The family tables and the rooflines are the lab's (`gemma4lab.inf2`)."""
