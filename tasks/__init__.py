"""Prefect tasks, one module per stage. Each reads artifacts, calls a library function, writes artifacts.

A task module never imports another task module; stages meet only through artifact ids in the store.
"""
