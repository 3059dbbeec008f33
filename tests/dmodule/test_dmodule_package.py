def test_dmodule_package_follows_the_rules(check_package):
    check_package("dmodule")
