from ds_exp.launch.cli import main

if __name__ == "__main__":
    main()
