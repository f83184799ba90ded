"""Data preparation: reading users' files and datasets, deduplication, decontamination and export."""
