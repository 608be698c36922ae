from ocrq_cli.main import main

main()
