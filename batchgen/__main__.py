from batchgen.cli import main

main()
