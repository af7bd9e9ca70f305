from memplan.cli import main

main()
