from spectrt.cli import main

main()
