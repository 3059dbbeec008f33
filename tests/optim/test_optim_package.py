def test_optim_package_follows_the_rules(check_package):
    check_package("optim")
