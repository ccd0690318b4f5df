from batchgen.cli import main

if __name__ == "__main__":  # not when a tokenizer process re-imports the main module
    main()
