"""`batchgen bench`: random-weight models of real shapes, the workloads of docs/architecture.md,
and a table comparing batchgen with Hugging Face on the same prompts."""
