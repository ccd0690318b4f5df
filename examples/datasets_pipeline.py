"""batchgen inside a Hugging Face datasets pipeline (runs on the CPU with the embedded model).

    python examples/datasets_pipeline.py        # or: make example

map -> generate -> filter, on one loaded engine, checkpointed under out/example: interrupt it
and run it again, and it resumes.
"""

from __future__ import annotations

import datasets

from batchgen import EngineConfig, Generator, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
]


def main() -> None:
    questions = datasets.Dataset.from_dict({"question": QUESTIONS, "topic": ["demo"] * 4})
    chats = questions.map(lambda row: {"messages": [{"role": "user", "content": row["question"]}]})
    with Generator("default", EngineConfig(max_num_seqs=16)) as generator:  # loaded once
        answers = generator(
            chats,
            messages_column="messages",
            system_prompt="Answer in one sentence.",
            sampling=SamplingParams(max_new_tokens=24, temperature=0.7, seed=0),
            checkpoint_dir="out/example/answers",
        )
        # the same engine again, now streamed: an IterableDataset in, an IterableDataset out
        stream = questions.to_iterable_dataset()
        drafts = generator(stream, template="Q: {question}\nA:", sampling={"max_new_tokens": 8})
        first_draft = next(iter(drafts))
    finished = answers.filter(lambda row: row["finish_reason"] != "error")
    for row in finished.select_columns(["question", "text", "num_generated_tokens"]):
        print(row)
    print("streamed:", first_draft["question"], "->", repr(first_draft["text"]))


if __name__ == "__main__":
    main()
