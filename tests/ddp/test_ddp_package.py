def test_ddp_package_follows_the_rules(check_package):
    check_package("ddp")
