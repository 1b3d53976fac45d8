"""One process among a run's ranks: the process group (process_group), which rank runs where (peers), stop signals
(signals), DeepSpeed's compiled ops (ops) and torch's build lock (build_lock), memory (memory). Layer 6, heavy. May
import: the light layers (core, config, data, resume, launch)."""
