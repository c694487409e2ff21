"""The worker: turns a SchedulerOutput into tensors, runs the model, samples."""
