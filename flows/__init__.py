"""Everything that runs the stages: the RL and data flows (Prefect), the stage -> task wrapper, the run config,
the run record, executors, schedules, OpenLineage events, the report and the `rlvr` command line."""
