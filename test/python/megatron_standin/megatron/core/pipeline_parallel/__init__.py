"""Stand-in of Megatron-Core's pipeline_parallel package (the schedules' loss handling)."""
