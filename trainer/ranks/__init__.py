"""Data-parallel ranks on FSDP2: the group and its processes, the bytes between them, what a rank does for each request, sharded state on disk, and a rank's serve loop."""
