"""Planning for inf2, computed on any machine: hardware facts, per-core memory, roofline, doctor."""
