from edgeq.cli import main

main()
