def test_data_package_follows_the_rules(check_package):
    check_package("data")
