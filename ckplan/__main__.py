from ckplan.cli import main

main()
