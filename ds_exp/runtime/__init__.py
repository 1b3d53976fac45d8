"""One process among the ranks of a run: the process group (process_group: rendezvous, collectives, lost peers),
which rank runs where (peers), stop signals (signals), DeepSpeed's compiled ops (ops) and torch's build lock they
take (build_lock), memory measured (memory).

Layer 6, heavy (torch, deepspeed). May import: the light layers (core, config, data, resume, launch).
"""
