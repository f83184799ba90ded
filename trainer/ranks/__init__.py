"""Data-parallel ranks on FSDP2: the group and its processes (launch.py), the bytes between them (transport.py),
what a rank does for each request (operations.py; sft.py for supervised steps), sharded state on disk (state.py),
and a rank's serve loop (serve.py)."""
