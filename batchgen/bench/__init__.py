"""`batchgen bench`: random-weight models of real shapes, the DESIGN.md workloads, and a table
comparing batchgen with Hugging Face on the same prompts."""
