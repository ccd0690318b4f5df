from batchgen.cli import main

if __name__ == "__main__":  # importing the module runs nothing
    main()
