"""The engine in a process of its own (EngineProcess, what a job's engine is on a GPU): the
protocol, the job's side and the engine's side."""
