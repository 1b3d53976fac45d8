from ds_exp.cli import main

if __name__ == "__main__":
    main()
