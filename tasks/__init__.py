"""The stages, one module per stage: its config section, its named inputs and outputs, and a plain `build`
function from inputs and config to the rows (and files) of its outputs. A build never reads or writes the
store: the stage runner (storage/stage.py) reads the inputs, checks whether the outputs are committed,
calls the build and commits what it returns; the flows (flows/stages.py) make each stage run a Prefect task
run. So a build is tested with `Inputs.given(...)`, without a store or Prefect.

A task module never imports another task module; stages meet only through artifact ids in the store.
"""
