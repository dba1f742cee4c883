from trainyard.cli import main

if __name__ == "__main__":  # not when a fork server imports this file as its main module
    main()
